//! Writing a backup: a bounded pipeline from the source's changed chunks to the target, then the
//! manifest.
//!
//! ```text
//!  changed chunk indexes ──► [read · zero check · hash · compress]  ──► [head? · put]  ──► chunk table
//!   (from Source::changes)     a blocking thread per chunk              async            (index → hash)
//!                              └──────── at most `uploads_in_flight` chunks in either ─────────┘
//! ```
//!
//! Each chunk in flight holds at most its read buffer and its stored form at once, so the memory
//! of a backup is bounded by `uploads_in_flight × (1 + chunk_size + stored_bound(chunk_size))`
//! ([`BackupOptions::buffer_bound`]) whatever the volume's size, plus the chunk table (40 bytes
//! per data chunk: 20 MiB per TiB of data at 2 MiB chunks). Chunks finish in any order, so one
//! slow upload holds back none of the others.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};
use tokio_util::sync::CancellationToken;

use crate::chunk::{self, ChunkHash};
use crate::error::Error;
use crate::layout::{self, VolumeKeys};
use crate::lease::{Held, is_live};
use crate::manifest::{self, Manifest, ManifestStats, chunk_len};
use crate::progress::{Buffer, Progress};
use crate::source::{Changes, Source};
use crate::store::BackupStore;

/// What to back up.
#[derive(Clone, Copy, Debug)]
pub struct BackupRequest<'a> {
    pub volume: &'a str,
    /// The new backup's id (the caller's: retrying with the same id resumes, see
    /// [`BackupStore::backup`]).
    pub backup: &'a str,
    /// The backup this one is incremental to: its chunk table is reused for everything the
    /// source says did not change since `parent`'s snapshot.
    pub parent: Option<&'a str>,
    /// The name of the snapshot the source reads, recorded for the next incremental.
    pub snapshot: Option<&'a str>,
}

#[derive(Clone, Copy, Debug)]
pub struct BackupOptions {
    /// The chunk size of a full backup (an incremental keeps its parent's).
    pub chunk_size: u64,
    /// Chunks being read, compressed or uploaded at once.
    pub uploads_in_flight: usize,
    /// zstd level (1: fastest; the default, see the crate docs).
    pub compression_level: i32,
}

impl Default for BackupOptions {
    fn default() -> Self {
        Self { chunk_size: manifest::DEFAULT_CHUNK, uploads_in_flight: 8, compression_level: 1 }
    }
}

impl BackupOptions {
    /// The most chunk-buffer memory a backup with these options holds at once.
    pub fn buffer_bound(&self, chunk_size: u64) -> u64 {
        let c = chunk_size as usize;
        (self.uploads_in_flight.max(1) * (1 + c + chunk::stored_bound(c))) as u64
    }
}

/// What one chunk turned out to be.
enum Read {
    Hole,
    /// The same bytes as the parent's chunk at this index.
    Unchanged(ChunkHash),
    Data(ChunkHash, Buffer),
}

impl BackupStore {
    /// Backs `source` up as backup `request.backup` of `request.volume` and returns its manifest.
    ///
    /// Only the chunks the source reports changed since the parent's snapshot are read; of
    /// those, only chunks the target does not already hold are uploaded (holes never are). The
    /// manifest is written last: until then the backup is not listed, and a crash or an error
    /// leaves only chunks, which a retry with the same id finds and reuses (or a collection
    /// removes once the lease of this attempt has expired). A retry of a backup that completed
    /// returns its manifest.
    ///
    /// Fails with [`Error::Busy`] while a garbage collection runs on the volume.
    #[tracing::instrument(name = "backup.create", skip_all, fields(volume = request.volume, backup = request.backup))]
    pub async fn backup(
        &self,
        request: BackupRequest<'_>,
        source: Arc<dyn Source>,
        options: &BackupOptions,
        progress: Arc<Progress>,
        cancel: &CancellationToken,
    ) -> Result<Manifest, Error> {
        let (volume, backup) = (request.volume, request.backup);
        layout::check_backup_id(backup)?;
        if let Some(p) = request.parent {
            layout::check_backup_id(p)?;
        }
        let keys = VolumeKeys::new(volume)?;
        if let Some(done) = self.try_manifest(&keys, volume, backup).await? {
            return Ok(done);
        }
        let lease = self.take_lease(&keys, volume, backup).await?;
        let result = self.backup_leased(request, &keys, source, options, &progress, cancel, &lease).await;
        lease.release().await;
        match &result {
            Ok(m) => tracing::info!(
                size = m.size,
                read = m.stats.read_bytes,
                uploaded = m.stats.uploaded_bytes,
                chunks = m.stats.uploaded_chunks,
                "backup complete"
            ),
            Err(e) => tracing::warn!(error = %e, "backup failed"),
        }
        result
    }

    /// Puts the backup's lease, then checks for a live collection lock (see `lease.rs`).
    async fn take_lease(&self, keys: &VolumeKeys, volume: &str, backup: &str) -> Result<Held, Error> {
        let body = serde_json::json!({ "backup": backup, "pid": std::process::id() }).to_string();
        let ttl = self.options.lease.ttl;
        let lease =
            Held::take(Arc::clone(&self.target), keys.lease(backup), Bytes::from(body), self.options.lease).await?;
        let gc = match self.target.head(&keys.gc_lock()).await {
            Ok(gc) => gc,
            Err(e) => {
                lease.release().await;
                return Err(e.into());
            }
        };
        if let Some(gc) = gc
            && is_live(gc.modified, lease.modified, ttl)
        {
            lease.release().await;
            return Err(Error::Busy { volume: volume.to_owned(), holder: "a garbage collection is running".into() });
        }
        Ok(lease)
    }

    #[allow(clippy::too_many_arguments, reason = "one private step of `backup`, which holds the lease")]
    async fn backup_leased(
        &self,
        request: BackupRequest<'_>,
        keys: &VolumeKeys,
        source: Arc<dyn Source>,
        options: &BackupOptions,
        progress: &Arc<Progress>,
        cancel: &CancellationToken,
        lease: &Held,
    ) -> Result<Manifest, Error> {
        let volume = request.volume;
        // Read under the lease: no collection runs until it is released, so every chunk the
        // parent names stays stored at least that long.
        let parent = match request.parent {
            Some(p) => Some(
                self.try_manifest(keys, volume, p)
                    .await?
                    .ok_or_else(|| Error::BackupNotFound { volume: volume.to_owned(), backup: p.to_owned() })?,
            ),
            None => None,
        };
        let chunk_size = parent.as_ref().map_or(options.chunk_size, |p| p.chunk_size);
        manifest::check_chunk_size(chunk_size).map_err(Error::Invalid)?;
        let size = source.size();
        let count = size.div_ceil(chunk_size);
        progress.set_total(size);

        // The parent's chunk at each index whose length is unchanged (a resize changes the
        // length of the chunk at the old end).
        let mut base: Vec<Option<ChunkHash>> = vec![None; usize::try_from(count).map_err(|_| too_big(size))?];
        if let Some(p) = &parent {
            for (i, h) in &p.chunks {
                if *i < count && chunk_len(size, chunk_size, *i) == p.chunk_len(*i) {
                    base[*i as usize] = Some(*h);
                }
            }
        }
        let since = parent.as_ref().and_then(|p| p.snapshot.clone());
        let changes = {
            let source = Arc::clone(&source);
            let since = since.clone();
            tokio::task::spawn_blocking(move || source.changes(since.as_deref()))
                .await
                .map_err(|e| Error::Source { volume: volume.to_owned(), offset: 0, source: std::io::Error::other(e) })?
                .map_err(|e| Error::Source { volume: volume.to_owned(), offset: 0, source: e })?
        };
        // With no parent snapshot to compare with, the ranges are "changed since all zeros".
        let changes = if parent.is_some() && since.is_none() { Changes::Everything } else { changes };
        let to_read = chunks_to_read(&changes, size, chunk_size, parent.as_ref());

        // Unread chunks keep the parent's hash (or stay holes).
        let mut table = base.clone();
        let read: u64 = to_read.iter().map(|i| chunk_len(size, chunk_size, *i)).sum();
        progress.skipped(size - read);

        // Chunks known stored: the parent's (no request needed). A full backup lists the
        // volume's chunks once instead of asking for each (none at all on a first backup, so it
        // costs what a plain upload does); an incremental, which uploads few, asks per chunk.
        let mut known: HashSet<ChunkHash> = parent.iter().flat_map(|p| p.chunks.iter().map(|(_, h)| *h)).collect();
        let listed = parent.is_none();
        if listed {
            let prefix = keys.chunks();
            let mut stored = self.target.list(&prefix);
            while let Some(obj) = stored.try_next().await? {
                known.extend(keys.chunk_of(&obj.key));
            }
        }
        let claimed = Mutex::new(HashSet::new());
        let base = Arc::new(base);
        let mut stats = ManifestStats::default();
        let in_flight = options.uploads_in_flight.max(1);
        let level = options.compression_level;

        let mut chunks = futures::stream::iter(to_read.iter().copied())
            .map(|i| {
                let (source, progress, base) = (Arc::clone(&source), Arc::clone(progress), Arc::clone(&base));
                let (known, claimed) = (&known, &claimed);
                async move {
                    let offset = i * chunk_size;
                    let len = chunk_len(size, chunk_size, i);
                    let read = tokio::task::spawn_blocking({
                        let progress = Arc::clone(&progress);
                        move || read_chunk(&*source, &progress, base[i as usize], offset, len, level)
                    })
                    .await
                    .map_err(std::io::Error::other)
                    .and_then(|r| r)
                    .map_err(|e| Error::Source {
                        volume: volume.to_owned(),
                        offset,
                        source: e,
                    })?;
                    let (hash, stored) = match read {
                        Read::Hole => {
                            progress.skipped(len);
                            return Ok::<_, Error>((i, None, 0));
                        }
                        Read::Unchanged(h) => {
                            progress.skipped(len);
                            return Ok((i, Some(h), 0));
                        }
                        Read::Data(h, stored) => (h, stored),
                    };
                    let first = !known.contains(&hash)
                        && claimed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(hash);
                    let key = keys.chunk(&hash);
                    // A chunk an earlier attempt (or another backup) stored is not sent again.
                    if !first || (!listed && self.target.head(&key).await?.is_some()) {
                        progress.deduplicated(len);
                        return Ok((i, Some(hash), 0));
                    }
                    let mut stored = stored;
                    let n = stored.data.len() as u64;
                    // The bytes move into the request without a copy; the buffer stays counted
                    // until the put is done with them.
                    let bytes = Bytes::from(std::mem::take(&mut stored.data));
                    self.target.put(&key, bytes).await?;
                    drop(stored);
                    progress.transferred(n);
                    Ok((i, Some(hash), n))
                }
            })
            .buffer_unordered(in_flight);

        loop {
            let next = tokio::select! {
                biased;
                () = cancel.cancelled() => return Err(Error::Cancelled { what: format!("backup {} of volume {volume}", request.backup) }),
                next = chunks.next() => next,
            };
            let Some(done) = next else { break };
            let (i, hash, uploaded) = done?;
            table[i as usize] = hash;
            stats.read_bytes += chunk_len(size, chunk_size, i);
            if uploaded > 0 {
                stats.uploaded_bytes += uploaded;
                stats.uploaded_chunks += 1;
            }
            if let Err(age) = lease.healthy() {
                return Err(lease_lost(volume, request.backup, age));
            }
        }
        drop(chunks);

        // Commit: the manifest makes the backup exist. Written only while the lease is surely
        // still live, so no collection can have removed a chunk it names.
        if let Err(age) = lease.healthy() {
            return Err(lease_lost(volume, request.backup, age));
        }
        let created_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let manifest = Manifest {
            format: manifest::FORMAT,
            volume: volume.to_owned(),
            backup: request.backup.to_owned(),
            parent: request.parent.map(str::to_owned),
            snapshot: request.snapshot.map(str::to_owned),
            size,
            chunk_size,
            created_ms,
            hash: "blake3".into(),
            compression: "zstd".into(),
            chunks: table.iter().enumerate().filter_map(|(i, h)| h.map(|h| (i as u64, h))).collect(),
            stats,
        };
        let body = serde_json::to_vec(&manifest).map_err(|e| Error::Invalid(e.to_string()))?;
        self.target.put(&keys.manifest(request.backup), Bytes::from(body)).await?;
        Ok(manifest)
    }
}

fn too_big(size: u64) -> Error {
    Error::Invalid(format!("a volume of {size} bytes has too many chunks for this machine"))
}

fn lease_lost(volume: &str, backup: &str, age: std::time::Duration) -> Error {
    Error::LeaseLost { volume: volume.to_owned(), backup: backup.to_owned(), seconds: age.as_secs() }
}

/// The chunk indexes to read, ascending: those a change touches, and with a parent of another
/// size the chunk at each end (its length changed).
fn chunks_to_read(changes: &Changes, size: u64, chunk_size: u64, parent: Option<&Manifest>) -> Vec<u64> {
    let count = size.div_ceil(chunk_size);
    let mut wanted = vec![false; count as usize];
    match changes {
        Changes::Everything => wanted.fill(true),
        Changes::Ranges(ranges) => {
            for r in ranges {
                let (start, end) = (r.start.min(size), r.end.min(size));
                if start < end {
                    let (first, last) = (start / chunk_size, (end - 1) / chunk_size);
                    wanted[first as usize..=last as usize].fill(true);
                }
            }
        }
    }
    if let Some(p) = parent
        && p.size != size
    {
        for i in [p.size.min(size) / chunk_size, p.size.max(size).saturating_sub(1) / chunk_size] {
            if let Some(w) = wanted.get_mut(i as usize) {
                *w = true;
            }
        }
        // A grown volume reads zeros past the old end unless written, which `changes` reports.
    }
    (0..count).filter(|i| wanted[*i as usize]).collect()
}

/// Reads chunk `[offset, offset + len)` and decides what it is; blocking.
fn read_chunk(
    source: &dyn Source,
    progress: &Arc<Progress>,
    base: Option<ChunkHash>,
    offset: u64,
    len: u64,
    level: i32,
) -> std::io::Result<Read> {
    // One byte of room before the data for the stored form's tag: raw data is stored from this
    // very buffer.
    let mut buf = progress.buffer(1 + len as usize);
    source.read_at(offset, &mut buf.data[1..])?;
    progress.read(len);
    if chunk::is_zero(&buf.data[1..]) {
        return Ok(Read::Hole);
    }
    let hash = ChunkHash::of(&buf.data[1..]);
    if base == Some(hash) {
        return Ok(Read::Unchanged(hash));
    }
    // `buf` stays counted until the stored form is (the same memory is counted twice for a
    // moment when stored raw: the measure errs high, never low).
    let stored = progress.adopt(chunk::encode_framed(std::mem::take(&mut buf.data), level)?);
    drop(buf);
    Ok(Read::Data(hash, stored))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_ranges_map_to_chunks_and_a_resize_rereads_the_ends() {
        let cs = 1 << 16;
        let ranges = Changes::Ranges(vec![0..1, (cs * 3 - 1)..(cs * 3 + 1), (cs * 9)..(cs * 20)]);
        assert_eq!(chunks_to_read(&ranges, cs * 10, cs, None), [0, 2, 3, 9]);
        assert_eq!(chunks_to_read(&Changes::Ranges(vec![]), cs * 10, cs, None), Vec::<u64>::new());
        assert_eq!(chunks_to_read(&Changes::Everything, cs * 2 + 1, cs, None), [0, 1, 2]);
        let mut parent = Manifest {
            format: manifest::FORMAT,
            volume: "v".into(),
            backup: "b".into(),
            parent: None,
            snapshot: None,
            size: cs * 4 + 100,
            chunk_size: cs,
            created_ms: 0,
            hash: "blake3".into(),
            compression: "zstd".into(),
            chunks: vec![],
            stats: ManifestStats::default(),
        };
        // Grown from 4 chunks + 100 bytes to 10 chunks: chunk 4 (the old short end) is reread.
        assert_eq!(chunks_to_read(&Changes::Ranges(vec![]), cs * 10, cs, Some(&parent)), [4, 9]);
        parent.size = cs * 10;
        assert_eq!(chunks_to_read(&Changes::Ranges(vec![]), cs * 10, cs, Some(&parent)), Vec::<u64>::new());
    }
}
