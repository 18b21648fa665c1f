//! Restoring a backup into a [`Sink`]: holes first (one call per run of holes), then the data
//! chunks, `downloads_in_flight` at a time in any order, each decompressed and checked against its
//! hash before a byte of it is written.

use std::sync::Arc;

use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::chunk;
use crate::error::{Error, TargetErrorKind};
use crate::layout::VolumeKeys;
use crate::manifest::Manifest;
use crate::progress::Progress;
use crate::sink::Sink;
use crate::store::BackupStore;

#[derive(Clone, Copy, Debug)]
pub struct RestoreOptions {
    /// Chunks being downloaded, checked or written at once; the memory bound of a restore is
    /// `downloads_in_flight × (stored_bound(chunk_size) + chunk_size)`.
    pub downloads_in_flight: usize,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        Self { downloads_in_flight: 8 }
    }
}

impl BackupStore {
    /// Restores `backup` of `volume` into `sink` and returns its manifest. Every chunk is
    /// checked: a chunk gone from the target is [`Error::MissingChunk`], one whose content does
    /// not match its hash [`Error::CorruptChunk`], each naming the hash and the volume offset.
    /// On any error the sink holds a partial restore the caller must not use.
    #[tracing::instrument(name = "backup.restore", skip_all, fields(volume = volume, backup = backup))]
    pub async fn restore(
        &self,
        volume: &str,
        backup: &str,
        sink: Arc<dyn Sink>,
        options: &RestoreOptions,
        progress: Arc<Progress>,
        cancel: &CancellationToken,
    ) -> Result<Manifest, Error> {
        let m = Arc::new(self.manifest(volume, backup).await?);
        let keys = VolumeKeys::new(volume)?;
        progress.set_total(m.size);
        let sink_err = |offset: u64, e: std::io::Error| Error::Sink { volume: volume.to_owned(), offset, source: e };

        for (offset, len) in hole_runs(&m) {
            let s = Arc::clone(&sink);
            tokio::task::spawn_blocking(move || s.write_zeros(offset, len))
                .await
                .map_err(std::io::Error::other)
                .and_then(|r| r)
                .map_err(|e| sink_err(offset, e))?;
            progress.skipped(len);
        }

        let mut chunks = futures::stream::iter(0..m.chunks.len())
            .map(|n| {
                let (m, sink, progress, keys) = (Arc::clone(&m), Arc::clone(&sink), Arc::clone(&progress), &keys);
                async move {
                    let (i, hash) = m.chunks[n];
                    let offset = i * m.chunk_size;
                    let len = m.chunk_len(i);
                    let stored = match self.target.get(&keys.chunk(&hash)).await {
                        Ok(b) => b,
                        Err(e) if e.kind == TargetErrorKind::NotFound => {
                            return Err(Error::MissingChunk {
                                volume: m.volume.clone(),
                                backup: m.backup.clone(),
                                hash,
                                offset,
                            });
                        }
                        Err(e) => return Err(e.into()),
                    };
                    progress.transferred(stored.len() as u64);
                    // The response body is this chunk's download buffer.
                    let counted = progress.count(stored.len() as u64);
                    let stored = (stored, counted);
                    let done = tokio::task::spawn_blocking(move || {
                        let data = chunk::decode(&stored.0, len as usize, &hash).map_err(Err)?;
                        drop(stored);
                        let data = progress.adopt(data);
                        sink.write_at(offset, &data.data).map_err(Ok)?;
                        progress.read(len);
                        Ok::<_, Result<std::io::Error, String>>(())
                    })
                    .await
                    .map_err(|e| Error::Sink {
                        volume: m.volume.clone(),
                        offset,
                        source: std::io::Error::other(e),
                    })?;
                    match done {
                        Ok(()) => Ok(()),
                        Err(Ok(io)) => Err(Error::Sink { volume: m.volume.clone(), offset, source: io }),
                        Err(Err(why)) => Err(Error::CorruptChunk {
                            volume: m.volume.clone(),
                            backup: m.backup.clone(),
                            hash,
                            offset,
                            why,
                        }),
                    }
                }
            })
            .buffer_unordered(options.downloads_in_flight.max(1));

        loop {
            let next = tokio::select! {
                biased;
                () = cancel.cancelled() => return Err(Error::Cancelled { what: format!("restore of backup {backup} of volume {volume}") }),
                next = chunks.next() => next,
            };
            match next {
                Some(done) => done?,
                None => break,
            }
        }
        drop(chunks);
        let s = Arc::clone(&sink);
        tokio::task::spawn_blocking(move || s.flush())
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r)
            .map_err(|e| sink_err(m.size, e))?;
        tracing::info!(size = m.size, chunks = m.chunks.len(), "restore complete");
        Ok(Arc::unwrap_or_clone(m))
    }
}

/// The byte ranges `(offset, len)` of the runs of chunks the manifest does not list (holes).
fn hole_runs(m: &Manifest) -> Vec<(u64, u64)> {
    let mut runs = Vec::new();
    let mut next = 0u64;
    let data = m.chunks.iter().map(|(i, _)| *i);
    for i in data.chain(std::iter::once(m.chunk_count())) {
        if i > next {
            let (start, end) = (next * m.chunk_size, (i * m.chunk_size).min(m.size));
            runs.push((start, end - start));
        }
        next = i + 1;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::ChunkHash;
    use crate::manifest::{FORMAT, ManifestStats};

    #[test]
    fn holes_are_the_runs_between_data_chunks() {
        let cs = 1 << 16;
        let h = ChunkHash::of(b"x");
        let mut m = Manifest {
            format: FORMAT,
            volume: "v".into(),
            backup: "b".into(),
            parent: None,
            snapshot: None,
            size: 6 * cs + 5,
            chunk_size: cs,
            created_ms: 0,
            hash: "blake3".into(),
            compression: "zstd".into(),
            chunks: vec![(1, h), (2, h), (5, h)],
            stats: ManifestStats::default(),
        };
        assert_eq!(hole_runs(&m), [(0, cs), (3 * cs, 2 * cs), (6 * cs, 5)]);
        m.chunks = vec![];
        assert_eq!(hole_runs(&m), [(0, 6 * cs + 5)]);
        m.chunks = (0..7).map(|i| (i, h)).collect();
        assert!(hole_runs(&m).is_empty());
    }
}
