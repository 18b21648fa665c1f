//! The manifest: everything a restore needs, written once per backup after every chunk it names is
//! stored. Its presence is what makes a backup exist.

use serde::{Deserialize, Serialize};

use crate::chunk::ChunkHash;

/// The format this crate writes and reads.
pub const FORMAT: u32 = 1;
/// Chunk sizes accepted: powers of two from 64 KiB to 16 MiB (a multiple of the 4 KiB block).
pub const MIN_CHUNK: u64 = 64 << 10;
pub const MAX_CHUNK: u64 = 16 << 20;
/// The default chunk size (the crate docs say why).
pub const DEFAULT_CHUNK: u64 = 2 << 20;

/// One complete backup of a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    /// The volume id, as given (not encoded).
    pub volume: String,
    pub backup: String,
    /// The backup this one was taken incrementally from, if any (informational: the chunk list is
    /// complete on its own, and deleting the parent takes nothing from this backup).
    pub parent: Option<String>,
    /// The source snapshot the data was read from: what the next incremental asks the volume's
    /// changes since.
    pub snapshot: Option<String>,
    /// The volume size in bytes.
    pub size: u64,
    pub chunk_size: u64,
    /// When the backup was committed, in milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// `"blake3"`: of each chunk's uncompressed bytes.
    pub hash: String,
    /// `"zstd"`: the compression of stored chunks (per chunk: or raw, by its tag byte).
    pub compression: String,
    /// The chunks holding data, by index (offset / chunk_size), ascending; an index not listed is
    /// all zeros (a hole).
    pub chunks: Vec<(u64, ChunkHash)>,
    /// What writing this backup took (informational).
    pub stats: ManifestStats,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestStats {
    /// Bytes read from the volume.
    pub read_bytes: u64,
    /// Bytes sent to the target (stored, compressed size).
    pub uploaded_bytes: u64,
    pub uploaded_chunks: u64,
}

impl Manifest {
    pub fn chunk_count(&self) -> u64 {
        self.size.div_ceil(self.chunk_size)
    }

    /// The length of chunk `index` (the last one may be short).
    pub fn chunk_len(&self, index: u64) -> u64 {
        chunk_len(self.size, self.chunk_size, index)
    }

    /// Every rule a reader relies on; a manifest breaking one is corrupt.
    pub fn check(&self, volume: &str, backup: &str) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format {} (this build reads {FORMAT})", self.format));
        }
        if self.volume != volume || self.backup != backup {
            return Err(format!("names volume {} backup {}", self.volume, self.backup));
        }
        check_chunk_size(self.chunk_size)?;
        if self.hash != "blake3" || self.compression != "zstd" {
            return Err(format!("hash {} compression {}", self.hash, self.compression));
        }
        let count = self.chunk_count();
        let mut prev = None;
        for (i, _) in &self.chunks {
            if *i >= count || prev.is_some_and(|p| p >= *i) {
                return Err(format!("chunk index {i} out of order or past the {count} chunks of the volume"));
            }
            prev = Some(*i);
        }
        Ok(())
    }
}

pub fn check_chunk_size(size: u64) -> Result<(), String> {
    if size.is_power_of_two() && (MIN_CHUNK..=MAX_CHUNK).contains(&size) {
        Ok(())
    } else {
        Err(format!("chunk size {size}: a power of two from {MIN_CHUNK} to {MAX_CHUNK}"))
    }
}

pub fn chunk_len(size: u64, chunk_size: u64, index: u64) -> u64 {
    size.saturating_sub(index * chunk_size).min(chunk_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            format: FORMAT,
            volume: "v".into(),
            backup: "b".into(),
            parent: None,
            snapshot: Some("s1".into()),
            size: 5 * MIN_CHUNK + 10,
            chunk_size: MIN_CHUNK,
            created_ms: 1,
            hash: "blake3".into(),
            compression: "zstd".into(),
            chunks: vec![(0, ChunkHash::of(b"a")), (5, ChunkHash::of(b"b"))],
            stats: ManifestStats::default(),
        }
    }

    #[test]
    fn json_round_trip_and_checks() {
        let m = sample();
        let text = serde_json::to_string(&m).expect("json");
        let back: Manifest = serde_json::from_str(&text).expect("parse");
        assert_eq!(back, m);
        back.check("v", "b").expect("valid");
        assert_eq!(m.chunk_count(), 6);
        assert_eq!(m.chunk_len(5), 10);
        assert!(m.check("v", "other").is_err());
        let mut bad = m.clone();
        bad.chunks.push((6, ChunkHash::of(b"c")));
        assert!(bad.check("v", "b").is_err());
        let mut bad = m;
        bad.chunks.swap(0, 1);
        assert!(bad.check("v", "b").is_err());
        assert!(check_chunk_size(3 << 20).is_err());
        assert!(check_chunk_size(DEFAULT_CHUNK).is_ok());
    }
}
