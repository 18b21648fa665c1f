//! Progress of one backup or restore, readable while it runs (for metrics and `volume status`),
//! and the accounting of the chunk buffers it holds, which is how its memory bound is measured.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters updated as the operation runs; [`Progress::snapshot`] reads them.
#[derive(Debug, Default)]
pub struct Progress {
    total: AtomicU64,
    read: AtomicU64,
    transferred: AtomicU64,
    skipped: AtomicU64,
    chunks_transferred: AtomicU64,
    chunks_deduplicated: AtomicU64,
    buffered: AtomicU64,
    peak_buffered: AtomicU64,
}

/// One reading of [`Progress`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgressSnapshot {
    /// Volume bytes the operation covers (the volume's size).
    pub total_bytes: u64,
    /// Backup: volume bytes read from the source. Restore: volume bytes written to the sink.
    pub read_bytes: u64,
    /// Stored (compressed) bytes uploaded by a backup, downloaded by a restore.
    pub transferred_bytes: u64,
    /// Volume bytes not transferred: unchanged since the parent, holes, or chunks the target
    /// already had.
    pub skipped_bytes: u64,
    pub chunks_transferred: u64,
    /// Chunks read and hashed but found already stored (within this backup, in the parent, or by
    /// an earlier attempt of this backup).
    pub chunks_deduplicated: u64,
    /// Bytes of chunk buffers held right now, and the most ever held at once.
    pub buffered_bytes: u64,
    pub peak_buffered_bytes: u64,
}

impl Progress {
    pub fn snapshot(&self) -> ProgressSnapshot {
        ProgressSnapshot {
            total_bytes: self.total.load(Relaxed),
            read_bytes: self.read.load(Relaxed),
            transferred_bytes: self.transferred.load(Relaxed),
            skipped_bytes: self.skipped.load(Relaxed),
            chunks_transferred: self.chunks_transferred.load(Relaxed),
            chunks_deduplicated: self.chunks_deduplicated.load(Relaxed),
            buffered_bytes: self.buffered.load(Relaxed),
            peak_buffered_bytes: self.peak_buffered.load(Relaxed),
        }
    }

    pub(crate) fn set_total(&self, n: u64) {
        self.total.store(n, Relaxed);
    }
    pub(crate) fn read(&self, n: u64) {
        self.read.fetch_add(n, Relaxed);
    }
    pub(crate) fn transferred(&self, n: u64) {
        self.transferred.fetch_add(n, Relaxed);
        self.chunks_transferred.fetch_add(1, Relaxed);
    }
    pub(crate) fn skipped(&self, n: u64) {
        self.skipped.fetch_add(n, Relaxed);
    }
    pub(crate) fn deduplicated(&self, n: u64) {
        self.skipped(n);
        self.chunks_deduplicated.fetch_add(1, Relaxed);
    }

    /// A zeroed buffer of `len` bytes, counted as held until the [`Buffer`] drops.
    pub(crate) fn buffer(self: &Arc<Self>, len: usize) -> Buffer {
        self.hold(len as u64);
        Buffer { data: vec![0; len], progress: Arc::clone(self), counted: len as u64 }
    }

    /// Counts `data` as held until the [`Buffer`] drops.
    pub(crate) fn adopt(self: &Arc<Self>, data: Vec<u8>) -> Buffer {
        let counted = data.capacity() as u64;
        self.hold(counted);
        Buffer { data, progress: Arc::clone(self), counted }
    }

    /// Counts `n` bytes held elsewhere (a response body) until the [`Buffer`] drops.
    pub(crate) fn count(self: &Arc<Self>, n: u64) -> Buffer {
        self.hold(n);
        Buffer { data: Vec::new(), progress: Arc::clone(self), counted: n }
    }

    fn hold(&self, n: u64) {
        let now = self.buffered.fetch_add(n, Relaxed) + n;
        self.peak_buffered.fetch_max(now, Relaxed);
    }
}

/// A chunk buffer counted in [`ProgressSnapshot::buffered_bytes`] while it lives.
pub(crate) struct Buffer {
    pub data: Vec<u8>,
    progress: Arc<Progress>,
    counted: u64,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.progress.buffered.fetch_sub(self.counted, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_counted_while_they_live() {
        let p = Arc::new(Progress::default());
        let a = p.buffer(100);
        let b = p.adopt(Vec::with_capacity(50));
        assert_eq!(p.snapshot().buffered_bytes, 150);
        drop(a);
        drop(b);
        let s = p.snapshot();
        assert_eq!((s.buffered_bytes, s.peak_buffered_bytes), (0, 150));
    }
}
